"""The agent core: one desk's loop, independent of exchanges, daemons and databases.

It talks to the rest through protocols it owns: :class:`ModelBackend` for the model, the
:class:`ToolRegistry` for tools, the :class:`EventBus` for whoever watches, and the
:class:`ConversationObserver` for whoever stores.

The names below are imported on first use, so that importing one module of the package (the
settings read :mod:`.context_budget`) does not load the loop, its tools' registry or pillow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trading_agent.agent.agent_loop import AgentLoop
    from trading_agent.agent.backend import (
        ModelBackend,
        ModelReply,
        ModelRequestSpec,
        Pricing,
        Usage,
    )
    from trading_agent.agent.context_compressor import ContextCompressor
    from trading_agent.agent.conversation import (
        ContentBlock,
        Conversation,
        ConversationObserver,
        ImageBlock,
        Message,
        TextBlock,
        ThinkingBlock,
        ToolResultBlock,
        ToolUseBlock,
    )
    from trading_agent.agent.event_bus import EventBus, Subscription
    from trading_agent.agent.hooks import ModelCallReport, Refuse
    from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
    from trading_agent.agent.retry import RetryPolicy
    from trading_agent.agent.steering_inbox import SteeringInbox, SteeringMessage
    from trading_agent.agent.tool_call_executor import ApprovalGate, ToolCallExecutor
    from trading_agent.agent.tool_registry import Tool, ToolContext, ToolOutput, ToolRegistry
    from trading_agent.agent.trigger import Trigger
    from trading_agent.agent.turn_runner import TurnResult
    from trading_agent.errors import BackendUnavailableError, ContextOverflowError

__all__ = [
    "AgentLoop",
    "ApprovalGate",
    "BackendUnavailableError",
    "ContentBlock",
    "ContextCompressor",
    "ContextOverflowError",
    "Conversation",
    "ConversationObserver",
    "EventBus",
    "ImageBlock",
    "ImageLimits",
    "ImagePreparer",
    "Message",
    "ModelBackend",
    "ModelCallReport",
    "ModelReply",
    "ModelRequestSpec",
    "Pricing",
    "Refuse",
    "RetryPolicy",
    "SteeringInbox",
    "SteeringMessage",
    "Subscription",
    "TextBlock",
    "ThinkingBlock",
    "Tool",
    "ToolCallExecutor",
    "ToolContext",
    "ToolOutput",
    "ToolRegistry",
    "ToolResultBlock",
    "ToolUseBlock",
    "Trigger",
    "TurnResult",
    "Usage",
]

_HOMES = {
    "AgentLoop": "agent_loop",
    "ApprovalGate": "tool_call_executor",
    "BackendUnavailableError": "trading_agent.errors",
    "ContentBlock": "conversation",
    "ContextCompressor": "context_compressor",
    "ContextOverflowError": "trading_agent.errors",
    "Conversation": "conversation",
    "ConversationObserver": "conversation",
    "EventBus": "event_bus",
    "ImageBlock": "conversation",
    "ImageLimits": "image_preparer",
    "ImagePreparer": "image_preparer",
    "Message": "conversation",
    "ModelBackend": "backend",
    "ModelCallReport": "hooks",
    "ModelReply": "backend",
    "ModelRequestSpec": "backend",
    "Pricing": "backend",
    "Refuse": "hooks",
    "RetryPolicy": "retry",
    "SteeringInbox": "steering_inbox",
    "SteeringMessage": "steering_inbox",
    "Subscription": "event_bus",
    "TextBlock": "conversation",
    "ThinkingBlock": "conversation",
    "Tool": "tool_registry",
    "ToolCallExecutor": "tool_call_executor",
    "ToolContext": "tool_registry",
    "ToolOutput": "tool_registry",
    "ToolRegistry": "tool_registry",
    "ToolResultBlock": "conversation",
    "ToolUseBlock": "conversation",
    "Trigger": "trigger",
    "TurnResult": "turn_runner",
    "Usage": "backend",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = home if home.startswith("trading_agent.") else f"{__name__}.{home}"
    return getattr(importlib.import_module(module), name)
