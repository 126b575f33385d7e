"""idleless.cache"""
