"""The seven workloads of docs/architecture.md, as (name, mask_mod, score_mod) for maskc, FlexAttention and SDPA.

They live in the package, where `maskc bench` runs them too; these scripts import them from here.
"""
from maskc.cli.bench import document_ids, workloads

__all__ = ["document_ids", "workloads"]
