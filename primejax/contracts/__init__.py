"""The two file contracts between processes: rollout batches (orchestrator -> trainer) and weight broadcasts
(trainer -> inference)."""
