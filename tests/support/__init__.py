"""Helpers the tests share (not tests): toy trees and their FUSE server, CLI runners, reader
wrappers, third-party plugin builds, fuzz input generators; ``paths`` names the repository."""
