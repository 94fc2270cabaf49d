"""The LoRA adapter transport: PEFT directories on disk, or adapter rounds over the collective wire."""
