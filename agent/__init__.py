"""rewarm: scale-to-zero LLM serving where every cold start after the first is a verified restore.

The import package is ``agent``; the distribution and command are ``rewarm``.
See ARCHITECTURE in the README for the tiers of warmth and the way a request flows.
"""

__version__ = "0.1.0"
