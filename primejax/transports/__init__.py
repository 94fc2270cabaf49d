"""How data crosses between the processes of a run: `weights/` (trainer -> inference servers)."""
