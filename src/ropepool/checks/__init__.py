"""The checks of a call, and the records they produce: nothing is written before they pass.

``validate``: every check of a call, for every framework, returning a frozen
``Call``; ``arrays``: the small checks every part uses (ints, shapes, strides,
where an array lives); ``pools``: pools, their layouts, dtypes and scales;
``blocks``, ``dsa``: the block-quantized and DeepSeek V3.2 caches;
``values``: slot and position values (read without a device sync);
``refusals``: features no backend row of the framework implements (as
support.py declares them). The facts they read (dtypes, layouts, stores)
are core/'s. Each message is listed in docs/errors.md.
"""
