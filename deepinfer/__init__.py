"""deepinfer: LLM serving as asyncio microservices over NATS."""
