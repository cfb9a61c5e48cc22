package client

import (
	"bytes"
	"fmt"
	"io"
	"net/http"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

type httpRoundTripper = http.RoundTripper

// pin is the server and CA bundle a rest.Config was built with.
type pin struct {
	server string
	ca     []byte
}

// roundTripper sets the spoke token on every request, and after a 401
// drops it and sends the request once more with a new one.
type roundTripper struct {
	src  *spokeSource
	pin  pin
	next http.RoundTripper
}

func (rt *roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	t, err := rt.tokenFor(req)
	if err != nil {
		return nil, err
	}
	resp, err := rt.next.RoundTrip(withBearer(req, t.value))
	if err != nil || resp.StatusCode != http.StatusUnauthorized {
		return resp, err
	}
	// The spoke no longer takes the token (revoked, or its signing key
	// rotated): drop it, and try once more if the body can be sent again.
	rt.src.invalidate(t.value)
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		return resp, nil
	}
	retry := req
	if req.GetBody != nil {
		body, err := req.GetBody()
		if err != nil {
			return resp, nil
		}
		retry = req.Clone(req.Context())
		retry.Body = body
	}
	t2, err := rt.tokenFor(req)
	if err != nil {
		return resp, nil
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	_ = resp.Body.Close()
	return rt.next.RoundTrip(withBearer(retry, t2.value))
}

// tokenFor returns the current token, provided it belongs to the pinned
// server and CA.
func (rt *roundTripper) tokenFor(req *http.Request) (*spokeToken, error) {
	t, err := rt.src.token(req.Context())
	if err != nil {
		return nil, err
	}
	if t.server != rt.pin.server || !bytes.Equal(t.ca, rt.pin.ca) {
		return nil, fmt.Errorf("cluster %s: the broker now answers server %s with another CA or URL than this config's "+
			"%s; not sending its token there: build a new config with RESTConfigFor: %w",
			rt.src.ref, t.server, rt.pin.server, errdefs.ErrPermissionDenied)
	}
	return t, nil
}

// withBearer returns a copy of req with the token set; req is not changed,
// as http.RoundTripper requires.
func withBearer(req *http.Request, tok string) *http.Request {
	r := req.Clone(req.Context())
	r.Header.Set("Authorization", "Bearer "+tok)
	return r
}
