"""The conductor's I/O-free scheduling core (index, estimators, Algorithm 1).

Driven by the HTTP conductor with wall-clock times and by the simulator
with a simulated clock; nothing in this package reads a clock or does I/O.
"""
from .decode_estimator import DecodeEstimator, fit_decode
from .estimators import (FlopsPrefillEstimator, ModelShape, PolynomialPrefillEstimator,
                         PrefillEstimator, fit_polynomial)
from .transfer_estimator import TransferEstimator
from .index import GlobalCacheIndex
from .policies import POLICIES, PlanContext, Policy
from .registry import make_policy
from .scheduler import Scheduler, SchedulerConfig, scheduler_config
from .state import (BookedJoin, Decision, DecodeLoad, DecodeNodeState, DecodeStep, NodeReport,
                    PrefillNodeState, PrefillPlan, Rejection, RunningSeq, ScheduleRequest,
                    TransferPlan)

__all__ = [
    "DecodeEstimator", "FlopsPrefillEstimator", "ModelShape", "PolynomialPrefillEstimator",
    "PrefillEstimator", "TransferEstimator", "fit_polynomial", "GlobalCacheIndex", "POLICIES",
    "PlanContext", "Policy", "make_policy", "Scheduler", "SchedulerConfig", "scheduler_config",
    "Decision",
    "DecodeNodeState", "NodeReport", "PrefillNodeState", "PrefillPlan", "Rejection",
    "ScheduleRequest", "TransferPlan", "BookedJoin", "DecodeLoad", "DecodeStep", "RunningSeq",
    "fit_decode",
]
