// Package hubkeys holds the public keys of the hub's service-account issuer
// and verifies bearer tokens against them locally, so that a forged token
// is refused before it costs the hub a TokenReview.
//
// Keys fetches the issuer's JSON Web Key Set from a Fetcher: FromHub reads
// kube-apiserver's /openid/v1/jwks through the hub REST client (the
// ClusterRole system:service-account-issuer-discovery allows it), FromFile
// reads a JWKS file. Run refreshes the set every RefreshInterval; a token
// that names an unknown key id (kid) triggers a refresh too, at most once per
// MinRefreshInterval (default 15s), so a flood of made-up key ids costs the
// hub at most four fetches a minute. A failed refresh keeps the last good
// set. Until a set has loaded, Verify fails closed with Unavailable.
//
// Verify accepts only tokens signed with one of Algorithms (asymmetric, as
// kube-apiserver signs; never "none" or HMAC) by a key of the set, with an
// exp claim, not expired and already valid (nbf, iat) within Leeway (default
// 1m), and whose aud claim includes Config.Audience. Anything else is
// Unauthenticated, with a message that names the reason and never quotes the
// token, and is counted in credbroker_hub_token_rejections_total{reason}.
//
// A token that passes is not thereby authenticated: only a TokenReview knows
// whether its ServiceAccount, Pod or Secret still exists. Verify is the
// cheap wall in front of the review, not a replacement for it.
//
//	keys, err := hubkeys.New(hubkeys.Config{
//		Fetcher:  hubkeys.FromHub(hubClient.CoreV1().RESTClient()),
//		Audience: "credbroker",
//	})
//	go keys.Run(ctx)
//	exp, err := keys.Verify(ctx, bearer)
//	if err != nil {
//		return err // Unauthenticated, or Unavailable before the first load
//	}
//	// cache what a TokenReview says of bearer no later than exp
package hubkeys
