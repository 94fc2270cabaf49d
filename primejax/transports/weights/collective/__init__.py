"""The collective transport: tensors straight from the trainer into the servers (gloo / NCCL), over an
authenticated rendezvous; the disk copy only where one is needed."""
