"""Grammar masks for response_format: the library wrapper (library.py) and a round's walk (walk.py)."""
