"""idleless.server"""
