// Package testpki is a throwaway PKI for tests and for the demo program: an
// in-memory ECDSA P-256 CA for one SPIFFE trust domain that issues X.509-SVIDs
// and ordinary TLS serving certificates, and writes them as PEM files.
//
// Nothing here is fit for production: keys live in memory, there is no
// revocation, and IssueSVID signs any SPIFFE ID it is given, even one outside
// the CA's trust domain, so that tests can build wrong certificates on purpose.
//
// Typical use in a test:
//
//	ca, err := testpki.NewCA("example.test")
//	require.NoError(t, err)
//	dir := t.TempDir()
//	certFile, keyFile, err := ca.WriteSVID(dir, "spiffe://example.test/broker")
//	require.NoError(t, err)
//	bundleFile, err := ca.WriteBundle(dir)
//	require.NoError(t, err)
//
// Functions return errors rather than taking a *testing.T, so the demo program
// can use them too.
package testpki
