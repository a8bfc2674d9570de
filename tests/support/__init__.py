"""Test support every suite shares, one home each: a free port (:mod:`support.ports`), polling with a
deadline (:mod:`support.waiting`), a child process that is always stopped (:mod:`support.process`) and
a Prometheus text-format reader (:mod:`support.prom`).

Importable as ``support`` from tests/ (pyproject's ``pythonpath``), from e2e/ and from bench/ (they put
tests/ on ``sys.path``)."""
