"""What a TrustClass may add to its engine pod, and what it may not: the flags of ``engine.extraArgs``
(:mod:`.engine_args`), the variables of ``engine.extraEnv`` (:mod:`.engine_env`) and where extra
volumes may be mounted (:mod:`.mounts`).

Each policy is one table. The CRD's CEL rules and the Python checks the operator runs are both
generated from it, so the API server and the operator refuse the same things with the same words.
Everything not on an allowlist is refused: a new flag or variable of a runtime is refused until it is
classified here.
"""
