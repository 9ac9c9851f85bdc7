"""engine.backend: http: one replica's engine on an OpenAI-compatible server, with LLMEngine's
interface.

config.py (HttpConfig: the servers and how to talk to them; torch-free, checked in the driver),
client.py (Endpoint: paced, retried JSON POSTs, standard library only), engine.py (HttpEngine:
the plan's rows as /v1/completions requests in plan order).
"""
