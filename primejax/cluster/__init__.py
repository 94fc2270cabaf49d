"""Multi-node runs on the scheduler a cluster already has: SLURM (`slurm.py` writes the job script,
`slurm_job.py` runs inside it) and Kubernetes (`k8s.py` writes the manifests). docs/multinode.md."""
