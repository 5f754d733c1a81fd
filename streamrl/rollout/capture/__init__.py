"""The capture endpoint: OpenAI (Chat Completions, Completions, Responses) and Anthropic (Messages)
routes whose calls are an episode's turns (server.py says how)."""

from .server import CaptureServer
from .toolcalls import PARSERS, load_parser

__all__ = ["PARSERS", "CaptureServer", "load_parser"]
