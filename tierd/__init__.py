"""tierd: a multi-tier KV-cache offloading daemon and its engine-side connector.

``tierd.gpu`` and ``tierd.connector`` are the top-level folders ``gpu/`` and ``connector/``,
reached through the committed links ``tierd/gpu`` and ``tierd/connector``: each module has exactly
one import name, in a checkout and in an installed wheel alike.
"""

__version__ = "0.1.0"
