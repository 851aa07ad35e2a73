"""The dry run: any rank of any planned layout, its real training step on fake tensors
under a fake process group (`python -m meshtrain dryrun`, docs/dry_run.md)."""
