"""kvfence's own small Kubernetes client, shared by the operator and the router.

- :mod:`kvfence.kube.connection`: where the API server is and how to authenticate to it (in-cluster
  ServiceAccount, or a kubeconfig: certificates, tokens, token files, basic auth, exec plugins), as
  one :class:`~kvfence.kube.connection.Connection` every transport reads;
- :mod:`kvfence.kube.watch`: the asynchronous side (aiohttp): paged lists, watches, and the
  list-then-watch loop the router's sources and the operator's Secret watch follow.

The operator's blocking requests (its reconcile workers) are :class:`kvfence.operator.apply.Kube`,
over ``urllib3`` with the same connection. There is no code generated from the OpenAPI here: every
caller reads and writes plain JSON objects, which is what the operator builds and what the router
reads. The ``kubernetes`` package is not used: importing it costs each process ~20-30 MiB, and kopf
imports it whenever it is installed.
"""
