"""Weight transports, trainer -> inference (docs/weight_transfer.md): one interface per direction (base.py), one
folder per transport (filesystem/, collective/) that registers itself by name (registry.py); adapters/ is a LoRA
run's disk format, which both use."""
