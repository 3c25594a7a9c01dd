"""One module per ``tierd`` command (``serve``, ``stats``, ``why``, ``route``, ``hash``, ``plan``,
``demo``): its flags and what it runs; ``tierd.cli`` dispatches to them.
"""
