"""Model integrations: ``ropepool.integrations.transformers`` (extra ``[hf]``).

Nothing is imported here, so ``import ropepool`` never pulls in transformers.
"""
