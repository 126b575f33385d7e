"""idleless.engine"""
