"""The old home of a pipeline rank's memory estimate, kept for its public names: the planner's fast path for
pipelines, now ``plan/pipeline_estimate.py`` (re-exported here)."""

from .plan.pipeline_estimate import StageActivations, estimate_pipeline, estimate_pipeline_rank, stage_activations

__all__ = ["StageActivations", "stage_activations", "estimate_pipeline_rank", "estimate_pipeline"]
