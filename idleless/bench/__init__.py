"""idleless.bench"""
