"""Tests of the desk tools."""
