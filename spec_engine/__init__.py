"""spec_engine: best-first tree speculative decoding on Hugging Face causal LMs (greedy, lossless).

Public API: `SpecEngine`, drafters `ModelDrafter`, `NgramDrafter`, `BlockDrafterAdapter`
(+ `MarkovBlockDrafter` test double), trees `ChainTree`, `BestFirstTree`, `IndependentTree` (DDTree-style).
The losslessness audit (token forcing) lives in `spec_engine.audit`.
"""

from .drafters import BlockDrafter, BlockDrafterAdapter, Drafter, MarkovBlockDrafter, ModelDrafter, NgramDrafter
from .engine import GenerationResult, SpecEngine, StepStats
from .tree import (
    BestFirstTree,
    ChainTree,
    DDTree,
    DraftRequest,
    IndependentTree,
    NodeLattice,
    PositionLattice,
    TreeBatch,
)

__all__ = [
    "BestFirstTree",
    "BlockDrafter",
    "BlockDrafterAdapter",
    "ChainTree",
    "DDTree",
    "DraftRequest",
    "Drafter",
    "GenerationResult",
    "IndependentTree",
    "MarkovBlockDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "NodeLattice",
    "PositionLattice",
    "SpecEngine",
    "StepStats",
    "TreeBatch",
]
