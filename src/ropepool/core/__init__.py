"""The floor every other part stands on: facts about arrays and formats, imported by checks, plan, reference
and backends alike, importing none of them.

``dtypes``: frameworks and dtypes by name, without importing a framework;
``layout``: every pool layout seen as ``[pages, page_size, heads, dim]`` (the views the backends and the oracle
write through); ``stores``: how a destination stores its rows (the ``Store`` record, one per destination);
``support``: what each backend row implements, declared as data (the checks read it, the rows are built from
it); ``step``: the arrays of one serving step, and what was made of them once.
"""
