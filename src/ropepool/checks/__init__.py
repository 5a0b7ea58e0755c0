"""The checks of a call, and the records they produce: nothing is written before they pass.

``validate``: every check of a call, for every framework, returning a frozen
``Call``; ``arrays``: the small checks every part uses (ints, shapes, strides,
where an array lives); ``pools``: pools, their layouts, dtypes and scales;
``values``: slot and position values (read without a device sync);
``layout``: every pool layout seen as ``[pages, page_size, heads, dim]``;
``dtypes``: frameworks and dtypes by name, without importing a framework.
Each message is listed in docs/errors.md.
"""
