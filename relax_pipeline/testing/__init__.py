"""Test doubles for users' and our own tests: scripted and paced engines, a stand-in `sglang` package.

Everything here fakes an edge (the engine, SGLang) and is named as a fake; the runtime never imports this
package (the import-contract test enforces it), so it may import anything below it.
"""
