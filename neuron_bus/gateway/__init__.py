"""The HTTP/WebSocket gateway: OpenAI-compatible API, WebSocket sessions, web page, metrics."""
