"""Tests of the trading layer: exchanges, the replay, risk."""
