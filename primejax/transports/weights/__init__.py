"""Collective weight transfer trainer -> vLLM (docs/weight_transfer.md): the wire protocol and the sender."""
