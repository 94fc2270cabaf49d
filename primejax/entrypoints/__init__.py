"""The top floor: one module per process (`python -m primejax.<process>` runs it by name), holding its main()
and the wiring that reads the whole config; nothing below imports it (docs/architecture.md#floors-and-arrows)."""
