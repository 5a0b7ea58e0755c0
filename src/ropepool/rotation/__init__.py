"""The rotation: what RoPE a call applies, reduced to one record every backend reads.

``spec``: ``RopeSpec`` (a model's rotary embedding) and ``CosSinCache`` (an
engine's own cos/sin table), both reduced to a ``Rotation``; ``scaling``: the
RoPE scaling types as data; ``hf_config``: ``RopeSpec.from_hf_config`` and
the model families as a table; ``norm``: ``QKNorm``, the per-head q/k norm
around the rotation, and reading it from transformers attention modules.
"""
