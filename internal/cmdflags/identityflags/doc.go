// Package identityflags holds the SPIFFE identity flags that the broker and
// the spoke agent share (--svid-cert-file, --svid-key-file,
// --trust-bundle-file, --spiffe-endpoint-socket, --spiffe-id and
// --trust-domain), bound to the identity.Config both their Configs embed.
// It stands apart from cmdflags so that the binaries without a SPIFFE
// identity (credbroker-plugin and the credbroker CLI) do not link
// pkg/identity:
//
//	var id identityflags.Flags
//	id.AddFlags(fs, &cfg.Config)
//	// parse fs, then
//	err := id.Apply()
package identityflags
