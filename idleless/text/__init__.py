"""idleless.text"""
