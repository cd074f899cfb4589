"""The top layer: the ``confkv`` command table and the commands that need both services.

Layers (checked by ``tests/test_layers.py``)::

    confkv_serve   the console script's command table; ``serve`` (scheduler + in-process worker), ``chat``
        ^
    worker_svc, scheduler_svc   side by side, talk only over gRPC, never import each other
        ^
    confkv, confkv_kernels, confkv_proto   core library (no network), kernels, generated wire code

``loadtest`` is a client beside this package: it may use the services, nothing imports it.
"""
