"""The engine layer: one `Request` per stage, the continuous-batching `Scheduler`, the worker
contract and the engine loop (schedule -> execute -> update_from_output). No gRPC here."""

from omnistage.engine.engine import Engine, EngineSink, StepObserver
from omnistage.engine.request import FinishReason, Request, RequestStatus
from omnistage.engine.scheduler import RequestRejected, ScheduledItem, Scheduler, SchedulerConfig
from omnistage.engine.worker import Demand, OutChunk, StageWorker, StepOutput

__all__ = [
    "Demand",
    "Engine",
    "EngineSink",
    "FinishReason",
    "OutChunk",
    "Request",
    "RequestRejected",
    "RequestStatus",
    "ScheduledItem",
    "Scheduler",
    "SchedulerConfig",
    "StageWorker",
    "StepObserver",
    "StepOutput",
]
