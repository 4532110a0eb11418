"""Local stand-ins for a cluster: an emulated API server and a pod runner (the demo and the tests).

Nothing here is needed in a cluster; it needs the ``demo`` extra (kmock).
"""
