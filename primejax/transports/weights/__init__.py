"""Weight transports, trainer -> inference (docs/weight_transfer.md): one interface per direction (base.py),
one folder per transport (filesystem/, collective/, adapters/) with its publisher and receiver."""
