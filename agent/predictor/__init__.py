"""The predictor: Holt forecaster, Little's-law targets, breakeven keep-alive, scale-in guard."""
