"""The model core (one Flax NNX decoder, its blocks, HF checkpoint interop, sharding rules, Orbax checkpoints)
and the family registry of models/families/, one file per HF model_type."""
