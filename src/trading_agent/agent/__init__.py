"""The agent core: one desk's loop, independent of exchanges, daemons and databases.

It talks to the rest through protocols it owns: :class:`ModelBackend` for the model, the
:class:`ToolRegistry` for tools, the :class:`EventBus` for whoever watches, and the
:class:`ConversationObserver` for whoever stores.
"""

from __future__ import annotations

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Pricing, Usage
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
