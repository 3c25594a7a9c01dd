"""The programs of ``tierd bench NAME``, one module per benchmark (plus the ``vllm serve`` stack
and the ``tierd serve`` launcher they and the tests start): each prints ratios against a limit
measured in the same run.
"""
