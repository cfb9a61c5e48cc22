package hubkeys

import (
	"context"
	"fmt"
	"io"
	"os"

	"k8s.io/client-go/rest"
)

// JWKSPath is where kube-apiserver serves its service-account issuer's
// public keys. The ClusterRole system:service-account-issuer-discovery
// allows reading it.
const JWKSPath = "/openid/v1/jwks"

// FromHub returns a Fetcher that reads JWKSPath through client, a REST
// client of the hub API server (such as a clientset's
// CoreV1().RESTClient()), so it uses the hub's address, CA and credentials.
func FromHub(client rest.Interface) Fetcher {
	return hubFetcher{client}
}

type hubFetcher struct{ client rest.Interface }

func (h hubFetcher) Fetch(ctx context.Context) ([]byte, error) {
	doc, err := h.client.Get().AbsPath(JWKSPath).DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("hubkeys: GET %s from the hub: %w", JWKSPath, err)
	}
	return doc, nil
}

// FromFile returns a Fetcher that reads a JWKS document from path on every
// fetch, for hubs whose keys are handed to the broker as a file (a mounted
// ConfigMap, say). With Keys' periodic refresh, changes are picked up within
// RefreshInterval, and an unchanged file is not parsed again.
func FromFile(path string) Fetcher {
	return fileFetcher(path)
}

type fileFetcher string

func (f fileFetcher) Fetch(context.Context) ([]byte, error) {
	file, err := os.Open(string(f))
	if err != nil {
		return nil, fmt.Errorf("hubkeys: %w", err)
	}
	defer file.Close()
	// One byte more than allowed, so parse can tell that it is too long.
	doc, err := io.ReadAll(io.LimitReader(file, MaxDocumentSize+1))
	if err != nil {
		return nil, fmt.Errorf("hubkeys: read %s: %w", string(f), err)
	}
	return doc, nil
}
