"""The engine's HTTP server (FastAPI + uvicorn), shared by every backend."""
