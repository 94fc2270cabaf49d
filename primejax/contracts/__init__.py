"""What the processes share besides HTTP: the run directory's layout, the rollout batch file (orchestrator ->
trainer) and the run's admin secret. The weight broadcasts (trainer -> inference) are the filesystem
transport's (primejax/transports/weights/filesystem/)."""
