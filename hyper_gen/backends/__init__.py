"""Framework adapters: one package per backend, registered in ``hyper_gen.registry``.

Each holds the ops protocol for its framework (``ops.py``), joining a launcher's job
(``launch.py``) and the per-framework model kernels (``models/<family>.py``). Nothing outside
this folder imports a framework.
"""
