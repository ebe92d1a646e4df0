"""EgressPolicy parsing and matching, forbidden addresses (with embedded IPv4 forms), and tenant ceilings."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from corral import InvalidRequestError, PermissionDeniedError
from corral.egress import EgressPolicy
from corral.egress._addresses import AddressGuard, host_addresses

# -- parsing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("network", "wire"), [
    ("none", "none"),
    (None, "none"),
    ([], "none"),
    ("internet", "internet"),
    (["PyPI.org."], ["pypi.org"]),
    (["*.Example.COM:443"], ["*.example.com:443"]),
    (["bücher.de"], ["xn--bcher-kva.de"]),
    (["[::1]:443", "::2", "10.0.0.1:5432"], ["10.0.0.1:5432", "[::1]:443", "[::2]"]),
    (["@packages"], ["@packages"]),
    (["a.org", "a.org", "@packages", "@packages"], ["a.org", "@packages"]),
    (["under_score.example.org"], ["under_score.example.org"]),
])
def test_parse_normalises_and_round_trips(network, wire):
    policy = EgressPolicy.parse(network)
    assert policy.to_wire() == wire
    assert EgressPolicy.parse(policy.to_wire()) == policy


@pytest.mark.parametrize(("bad", "words"), [
    ([""], "empty"),
    (["a*.b.com"], "wildcard"),
    (["*"], "wildcard"),
    (["*.*.com"], "wildcard"),
    (["foo.*"], "wildcard"),
    (["*.10.0.0.1"], "IP address"),
    (["a\x00b.com"], "NUL"),
    (["a b.com"], "whitespace"),
    (["x.com:0"], "bad port"),
    (["x.com:65536"], "bad port"),
    (["x.com:http"], "bad port"),
    (["x.com:"], "bad port"),
    (["[::1"], "unclosed"),
    (["[x.com]:80"], "IPv6"),
    (["@nope"], "unknown preset"),
    (["https://pypi.org"], "not a URL"),
    (["-bad.com"], "bad label"),
    (["a..b.com"], "IDNA"),
    (["a" * 64 + ".com"], "IDNA"),
    (["internet"], "on its own"),
    (["none", "a.com"], "on its own"),
    ([5], "string"),
    ("pypi.org", "a list of hosts"),
    ("all", "a list of hosts"),
    (42, "a list of hosts"),
])
def test_parse_refuses_bad_input_clearly(bad, words):
    with pytest.raises(InvalidRequestError) as info:
        EgressPolicy.parse(bad)
    assert words in info.value.message


@pytest.mark.parametrize("bad", ["10.0.0.5", "db.internal:5432", "10.0.0.5:0", "[fd00::1]", "", 7])
def test_private_needs_exact_ip_and_port(bad):
    with pytest.raises(InvalidRequestError, match="invalid private address"):
        EgressPolicy.parse("none", private=[bad])


def test_private_is_normalised():
    policy = EgressPolicy.parse("internet", private=["127.0.0.1:8080", "[FD00::0005]:443", "127.0.0.1:8080"])
    assert policy.private == ("127.0.0.1:8080", "[fd00::5]:443")
    assert policy.allows_private("fd00::5", 443)
    assert not policy.allows_private("fd00::5", 444)
    assert not policy.allows_private("127.0.0.1", 8081)


# -- matching --------------------------------------------------------------------------------------------------

ALLOW = EgressPolicy.parse(["pypi.org", "*.example.com", "api.test:443", "10.1.2.3", "[::1]:443", "@packages"])


@pytest.mark.parametrize(("host", "port", "allowed"), [
    ("pypi.org", 443, True),
    ("pypi.org", 80, True),
    ("files.pypi.org", 443, False),
    ("a.example.com", 443, True),
    ("a.b.example.com", 80, True),
    ("example.com", 443, False),
    ("example.com.evil.net", 443, False),
    ("evilexample.com", 443, False),
    ("api.test", 443, True),
    ("api.test", 80, False),
    ("10.1.2.3", 22, True),
    ("10.1.2.33", 22, False),
    ("::1", 443, True),
    ("::1", 80, False),
    ("internet", 80, False),
])
def test_allowlist_matching(host, port, allowed):
    assert ALLOW.check(host, port).allowed is allowed


def test_matching_after_normalisation():
    from corral.egress._policy import normalize_host

    for raw in ("PYPI.ORG", "pypi.org.", "PyPi.Org."):
        assert ALLOW.check(normalize_host(raw), 443).allowed
    assert normalize_host("Bücher.DE.") == "xn--bcher-kva.de"
    assert normalize_host("[0:0::1]") == "::1"
    assert EgressPolicy.parse(["bücher.de"]).check(normalize_host("BÜCHER.de"), 443).allowed


def test_wildcards_never_match_ip_literals():
    policy = EgressPolicy.parse(["*.3.4"])
    assert policy.check("a.3.4", 80).allowed
    assert not policy.check("1.2.3.4", 80).allowed


def test_decision_names_the_rule():
    assert ALLOW.check("a.example.com", 1).rule == "allow *.example.com"
    assert ALLOW.check("nope.org", 1).rule == "not in allowlist"
    assert EgressPolicy.parse("none").check("pypi.org", 443).rule == "policy none"
    assert EgressPolicy.parse("internet").check("pypi.org", 443).rule == "policy internet"


def test_presets():
    assert ALLOW.grants_preset("packages")
    assert EgressPolicy.parse("internet").grants_preset("packages")
    assert not EgressPolicy.parse("none").grants_preset("packages")
    assert not EgressPolicy.parse(["pypi.org"]).grants_preset("packages")
    only = EgressPolicy.parse(["@packages"])
    assert only.mode == "allowlist" and not only.check("pypi.org", 443).allowed  # "none, but pip and npm work"


# -- ceilings --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "ceiling"), [
    ("none", "none"),
    ("none", ["a.org"]),
    (["a.org"], "internet"),
    ("internet", "internet"),
    (["a.org:443"], ["a.org"]),
    (["x.example.com", "*.a.example.com:443", "*.example.com"], ["*.example.com"]),
    (["@packages"], ["@packages"]),
    (["@packages", "pypi.org"], "internet"),
    (["10.0.0.1:22"], ["10.0.0.1"]),
])
def test_within_ceiling(policy, ceiling):
    EgressPolicy.parse(policy).within(EgressPolicy.parse(ceiling))


@pytest.mark.parametrize(("policy", "ceiling", "named"), [
    ("internet", ["a.org"], "'internet'"),
    ("internet", "none", "'internet'"),
    (["a.org"], "none", "'a.org'"),
    (["a.org"], ["a.org:443"], "'a.org'"),
    (["example.com"], ["*.example.com"], "'example.com'"),
    (["*.example.com"], ["*.a.example.com"], "'*.example.com'"),
    (["@packages"], ["pypi.org"], "'@packages'"),
    (["1.2.3.4"], ["*.3.4"], "'1.2.3.4'"),
])
def test_beyond_ceiling_names_the_excess(policy, ceiling, named):
    with pytest.raises(PermissionDeniedError) as info:
        EgressPolicy.parse(policy).within(EgressPolicy.parse(ceiling))
    assert named in info.value.message and "ceiling" in info.value.message


def test_private_pairs_need_the_ceiling_too():
    ceiling = EgressPolicy.parse("internet", private=["10.0.0.5:5432"])
    EgressPolicy.parse(["db.test"], private=["10.0.0.5:5432"]).within(ceiling)
    with pytest.raises(PermissionDeniedError, match=r"10\.0\.0\.6:5432"):
        EgressPolicy.parse(["db.test"], private=["10.0.0.6:5432"]).within(ceiling)


# -- forbidden addresses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "label"), [
    ("127.0.0.1", "loopback"),
    ("127.255.0.9", "loopback"),
    ("::1", "loopback"),
    ("10.0.0.1", "RFC 1918"),
    ("172.16.5.4", "RFC 1918"),
    ("192.168.1.1", "RFC 1918"),
    ("169.254.169.254", "cloud metadata"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("100.64.0.1", "CGNAT"),
    ("100.127.255.254", "CGNAT"),
    ("fc00::1", "ULA"),
    ("fdff::1", "ULA"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.251", "multicast"),
    ("ff02::1", "multicast"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.1", "reserved"),
    ("198.18.0.1", "benchmarking"),
    ("::ffff:127.0.0.1", "embeds 127.0.0.1: loopback"),
    ("::ffff:169.254.169.254", "embeds 169.254.169.254"),
    ("::ffff:10.0.0.1", "embeds 10.0.0.1"),
    ("64:ff9b::a9fe:a9fe", "embeds 169.254.169.254"),
    ("64:ff9b::7f00:1", "embeds 127.0.0.1"),
    ("64:ff9b:1::1", "NAT64 local-use"),
    ("2002:7f00:1::", "embeds 127.0.0.1"),
    ("2002:a00:1::", "embeds 10.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
    ("::127.0.0.1", "IPv4-compatible"),
    ("fec0::1", "site-local"),
])
def test_forbidden_addresses(address, label):
    why = AddressGuard().forbidden(ipaddress.ip_address(address))
    assert why is not None and label in why


# Documentation ranges are not private networks (see _addresses._NOT_PRIVATE): this CI reaches PyPI through one.
@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808", "2002:808:808::1", "100.63.255.255", "100.128.0.1",
                                     "192.0.2.7", "198.51.100.7", "203.0.113.80", "2001:db8::1"])
def test_public_addresses_pass(address):
    assert AddressGuard().forbidden(ipaddress.ip_address(address)) is None


def test_extra_forbidden_networks():
    guard = AddressGuard(["8.8.8.0/24"])
    assert guard.forbidden(ipaddress.ip_address("8.8.8.8")) == "forbidden by the operator"
    assert guard.forbidden(ipaddress.ip_address("::ffff:8.8.8.8")) is not None
    assert guard.forbidden(ipaddress.ip_address("8.8.4.4")) is None


def test_host_addresses_are_forbidden():
    own = host_addresses()
    assert ipaddress.ip_address("127.0.0.1") in own
    guard = AddressGuard()
    for ip in own:
        assert guard.forbidden(ip) is not None
        if not ip.is_loopback:
            assert guard.forbidden(ip) == "this host's own address"


def test_host_addresses_parsers(tmp_path: Path):
    (tmp_path / "fib_trie").write_text(
        "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n"
        "     |-- 8.8.8.8\n        /32 host LOCAL\n     |-- 8.8.8.255\n        /32 link BROADCAST\n")
    (tmp_path / "if_inet6").write_text("26064700470000000000000000001111 02 40 00 80     eth0\n")
    assert host_addresses(tmp_path) == {ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("2606:4700:4700::1111")}
    assert host_addresses(tmp_path / "missing") == frozenset()
