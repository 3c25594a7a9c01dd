"""The cluster tier: the Redis directory of which node holds which blocks (``directory``), each
node's publisher into it (``publisher``) and the remote tier that fetches from a peer
(``remote``).
"""
